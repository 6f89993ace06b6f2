"""The core's protocols implemented on third-party libraries, imported only where a run configures them:
torchft's Lighthouse and Manager behind `Membership` (`torchft_membership.py`), and obstore behind the store
exchange's `ObjectStore` (`object_store.py`)."""
