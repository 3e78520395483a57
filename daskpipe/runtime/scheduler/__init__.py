"""The scheduler process: the plugin that routes and batches requests, and what it keeps of them. No torch here."""
