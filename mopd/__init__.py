"""mopd: multi-teacher on-policy distillation."""
