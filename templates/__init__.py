"""pagecast."""
