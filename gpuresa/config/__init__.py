"""The configuration: sections, schema, checks and units."""
