"""The directory ``upd record`` prepends to ``PYTHONPATH``: it holds only ``sitecustomize.py``, which Python imports
at the start of every process (the package marker is for packaging; this directory is never imported as a
package)."""
