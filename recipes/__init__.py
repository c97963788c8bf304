"""Complete presets loaded with +recipe=NAME, and example Trainer subclasses."""
