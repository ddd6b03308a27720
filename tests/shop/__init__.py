"""A project's own order model, as a shop adopting the app would write it (the swapped suite)."""
