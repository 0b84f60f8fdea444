"""Outputs after the session: the SFTP output service, hand-over, retention, the output disk."""
