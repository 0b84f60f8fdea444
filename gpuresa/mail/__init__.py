"""Mail: the SMTP gateway, the text of every notice, the outbox."""
