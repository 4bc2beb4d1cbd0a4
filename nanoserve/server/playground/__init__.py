"""The playground at `/`: a page (index.html, app.js, style.css: static files, no build step, no
CDN) that streams chat and completions, shows each server's status light and live figures,
races nanoserve against the `--playground-peer` servers, and draws each request's timeline.

page.py     GET / and the page's files, and the page's settings (/playground/config.json)
peers.py    /v1/playground/peers/{name}/...: the peers reached through this server
"""
