"""Optional integrations with other libraries (imported on demand)."""
