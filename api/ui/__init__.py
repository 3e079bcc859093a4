"""The web dashboard at ``/ui``: server-rendered pages with small islands of JavaScript.

Why this shape: every page is a Jinja template rendered by the same FastAPI app (layout,
navigation, the signed-in principal, the CSRF token) plus one small vanilla-JS file that
calls the public JSON API (``/v1/...``) with the session cookie and keeps itself live
(polling, and Server-Sent Events on the job page). There is no build step and no npm at
install or run time: the only third-party asset is uPlot (MIT), a ~50 KB charting
library vendored from the npm registry into ``static/vendor/uplot/`` with its LICENSE.
A single-page-app bundle would add a toolchain, a second router and a second copy of the
API's shapes for four pages that are mostly tables and charts; server-rendered shells
keep auth, 404s and redirects on the server where the API's rules already live.

Modules:
    session  signed cookie sessions (API key row id + CSRF token) and CSRF checks; the
             API's auth dependency calls ``session_api_key`` to accept the cookie.
    routes   login/logout and the page routes; ``mount_ui(app)`` adds everything.
    data     dashboard-only JSON (jobs table with filters and latest metrics, tenants,
             resolved "auto" hyperparameters).
"""
