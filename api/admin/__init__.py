"""Admin routes: tenants and API keys.
"""
