"""The only place that knows other libraries' versions and reaches past their public API (see each module)."""
