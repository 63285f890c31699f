"""Model multiplexing example: several tiny checkpoints behind one service (see main.py)."""
