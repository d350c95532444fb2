"""Which layouts distrain runs: THE rule table (rules.py) over the facts a config, its model
shape and the world size determine (facts.py), consulted by the launcher and the workers alike."""
