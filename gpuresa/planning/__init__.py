"""The pure planner: actions, GPU and port allocation."""
