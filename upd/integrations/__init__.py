"""Bridges to other tools, each in its own module and imported only when used (the tool is an optional extra)."""
