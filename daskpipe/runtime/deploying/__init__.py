"""Placing, profiling and starting stage actors, from whichever process deploys: the client at ``deploy``, the scheduler at a re-plan."""
