"""Test-only plugins, loaded the way users load theirs (`--engine-backend MODULE:NAME`)."""
