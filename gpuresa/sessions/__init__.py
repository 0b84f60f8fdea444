"""What every session backend shares and none owns: the protocol, errors, labels, specs.

A backend imports from here; nothing here imports a backend.
"""
