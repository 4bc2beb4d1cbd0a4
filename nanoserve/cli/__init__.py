"""The command line: `nanoserve serve`, `nanoserve chat` (the terminal client) and
`nanoserve bench`."""
