"""`speedtronic dashboard`: a local, read-only web page for runs folders and DiLoCo swarms.

- collect.py: what each source (a folder of runs, a swarm's bus) says now, polled in the background;
- history.py: a swarm's curves, rounds and token rates, built up from its successive status documents;
- server.py: the HTTP server (stdlib), its JSON endpoints and the static page (static/, package data).

Never imports torch at import time; the page needs no network beyond this server (no CDN).
"""
