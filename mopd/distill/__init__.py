"""MOPD: routing, teacher scoring, loss, trainer, pair mode."""
