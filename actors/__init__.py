"""flare's runtime: trio actors that turn scheduler plans into executed frames and
frames into published tokens. ``system.py`` is the one place that opens channels."""
