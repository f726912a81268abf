"""Worker: holds a model replica, evaluates chunks, applies every committed step."""
