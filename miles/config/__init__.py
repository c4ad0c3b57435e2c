"""The argument schema of every miles job. Never imports torch or Ray."""
