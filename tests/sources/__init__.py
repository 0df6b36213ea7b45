"""convert / expand / info / estimate on files and folders, the CLI, outputs, faults, a new user's first hour."""
