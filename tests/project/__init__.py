"""The checkout as a whole: packaging, README and docs recipes, pointers, tools, checkout names, deprecated names."""
