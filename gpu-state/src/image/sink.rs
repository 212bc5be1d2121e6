//! [`AllocationSink`]: an allocation written as a byte stream through `std::io::Write`.
//! Bytes are gathered straight into a staging buffer; each full chunk is submitted.

use std::io::{self, Write};

use super::error::ImageError;
use super::staging::StagingBuf;
use super::writer::ImageWriter;
use super::AllocId;

/// Writes one allocation in order, from offset 0. Call [`AllocationSink::close`] to check
/// that the whole allocation was written; a dropped sink discards a partial chunk (its buffer goes back to the pool), and
/// the writer's `finish` then reports the missing chunk.
pub struct AllocationSink<'w> {
    writer: &'w mut ImageWriter,
    alloc: AllocId,
    size: u64,
    /// Offset of the chunk being filled.
    chunk_offset: u64,
    staging: Option<StagingBuf>,
    filled: usize,
}

impl<'w> AllocationSink<'w> {
    pub(crate) fn new(writer: &'w mut ImageWriter, alloc: AllocId) -> Self {
        let size = writer.allocation_size(alloc);
        AllocationSink {
            writer,
            alloc,
            size,
            chunk_offset: 0,
            staging: None,
            filled: 0,
        }
    }

    /// Bytes written so far.
    pub fn position(&self) -> u64 {
        self.chunk_offset + self.filled as u64
    }

    /// Checks the allocation was written in full.
    pub fn close(self) -> Result<(), ImageError> {
        if self.position() != self.size {
            return Err(ImageError::Usage(format!(
                "allocation sink closed at {} of {} bytes",
                self.position(),
                self.size
            )));
        }
        Ok(())
    }

    fn chunk_len(&self) -> usize {
        (self.writer.chunk_size() as u64).min(self.size - self.chunk_offset) as usize
    }

    fn submit(&mut self) -> Result<(), ImageError> {
        let (index, len) = self.writer.slot(self.alloc, self.chunk_offset)?;
        let buf = self.staging.take().expect("a full chunk is staged");
        self.writer.submit(self.alloc, index, buf, len)?;
        self.chunk_offset += len as u64;
        self.filled = 0;
        Ok(())
    }
}

impl Write for AllocationSink<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if data.is_empty() {
            return Ok(0);
        }
        if self.position() >= self.size {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("allocation is {} bytes; no room for more", self.size),
            ));
        }
        if self.staging.is_none() {
            let buf = self.writer.acquire().map_err(io::Error::other)?;
            self.staging = Some(buf);
        }
        let len = self.chunk_len();
        let take = data.len().min(len - self.filled);
        let staging = self.staging.as_mut().expect("just staged");
        staging[self.filled..self.filled + take].copy_from_slice(&data[..take]);
        self.filled += take;
        if self.filled == len {
            self.submit().map_err(io::Error::other)?;
        }
        Ok(take)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
