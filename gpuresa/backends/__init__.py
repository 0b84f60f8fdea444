"""Session backends: the protocol every one speaks (`protocol`), and which serves a host."""
