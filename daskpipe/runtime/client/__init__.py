"""The client process: ``deploy``, the service it returns, and request futures."""
