from storage.store import Store, StoreError

__all__ = ["Store", "StoreError"]
