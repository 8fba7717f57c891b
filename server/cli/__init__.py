"""The `flashserve` command (`main`) and its terminal chat (`chat`). Imports anything."""
