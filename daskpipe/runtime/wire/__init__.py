"""What travels between the processes: message vocabulary, daskpipe's own streams, request inputs. No torch here."""
