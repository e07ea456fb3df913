"""The local cluster launcher: topology description, process supervisor and run-dir state."""
