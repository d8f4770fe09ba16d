"""A stand-in `sglang` package for tests: only the server process is replaced (see launch_server)."""
