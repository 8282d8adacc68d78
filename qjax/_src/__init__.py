"""qjax internals; the public API is re-exported from qjax."""
