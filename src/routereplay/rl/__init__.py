"""The embedded default: a synthetic task, a tiny MoE that learned it, trainer-side scoring, demo."""
