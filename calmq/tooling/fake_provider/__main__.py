"""``python -m calmq.tooling.fake_provider``."""

from calmq.tooling.fake_provider.app import main

main()
