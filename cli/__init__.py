"""The `tandem` command (`cli.main:main`): it sits on top of everything it starts."""
