"""The scheduler's elastic controller: re-plans as workers come and go or the load mix shifts."""
