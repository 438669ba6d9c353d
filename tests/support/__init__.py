"""What the tests share: worker processes, job helpers, the plain-transformers reference, the
architecture sweep's tiny models, a model that can block. Test files import from here, never
from each other; fixtures live in ``tests/conftest.py``."""
