"""An in-memory file that counts the bytes read from it: proves what a reader touches."""

import io


class CountingFile(io.BytesIO):
    """``io.BytesIO`` whose ``bytes_read`` is the total returned by ``read`` so far."""

    bytes_read = 0

    def read(self, n=-1):
        data = super().read(n)
        self.bytes_read += len(data)
        return data
