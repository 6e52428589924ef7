"""Plugins: the loader, the EP wrapper, the host API served to plugins, the environment."""
