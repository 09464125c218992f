//! Length-prefixed frames on exchange and state-sync streams.
//!
//! A frame is `kind: u8 | length: u32 little-endian | body[length]`. Every read is bounded
//! by a caller-supplied maximum, checked before anything is allocated.

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Body: an `ExchangeHeader` (protobuf).
pub const FRAME_HEADER: u8 = 1;
/// Body: 32-byte BLAKE3 of the encoded bytes, then the encoded bytes of one chunk.
pub const FRAME_CHUNK: u8 = 2;
/// Body: a `Refusal` (protobuf).
pub const FRAME_REFUSAL: u8 = 3;
/// Body: a `StateRequest` (protobuf).
pub const FRAME_STATE_REQUEST: u8 = 4;
/// Empty body: the sender received the peer's whole payload and verified it (the last frame
/// of each side of an exchange).
pub const FRAME_DONE: u8 = 5;

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("stream closed before a frame")]
    Eof,
    #[error("stream ended inside a frame")]
    Truncated,
    #[error("frame of kind {kind} has {len} bytes, more than the limit of {max}")]
    TooLarge { kind: u8, len: u64, max: u64 },
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

fn eof_is_truncation(e: std::io::Error) -> FrameError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        FrameError::Truncated
    } else {
        FrameError::Io(e)
    }
}

/// Writes one frame whose body is the concatenation of `parts`.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: u8,
    parts: &[&[u8]],
) -> std::io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let len = u32::try_from(len)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "frame over 4 GiB"))?;
    let mut prefix = [0u8; 5];
    prefix[0] = kind;
    prefix[1..].copy_from_slice(&len.to_le_bytes());
    w.write_all(&prefix).await?;
    for part in parts {
        w.write_all(part).await?;
    }
    Ok(())
}

/// Reads one frame's kind and length; refuses a length over `max(kind)`.
pub async fn read_frame_prefix<R: AsyncRead + Unpin>(
    r: &mut R,
    max: impl Fn(u8) -> u64,
) -> Result<(u8, u32), FrameError> {
    let mut kind = [0u8; 1];
    if r.read(&mut kind).await? == 0 {
        return Err(FrameError::Eof);
    }
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await.map_err(eof_is_truncation)?;
    let len = u32::from_le_bytes(len);
    let limit = max(kind[0]);
    if u64::from(len) > limit {
        return Err(FrameError::TooLarge {
            kind: kind[0],
            len: len.into(),
            max: limit,
        });
    }
    Ok((kind[0], len))
}

/// Reads a whole frame (kind, body), refusing a body longer than `max(kind)`.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: impl Fn(u8) -> u64,
) -> Result<(u8, Vec<u8>), FrameError> {
    let (kind, len) = read_frame_prefix(r, max).await?;
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).await.map_err(eof_is_truncation)?;
    Ok((kind, body))
}

/// Succeeds only if the stream is at its end (the peer closed its side).
pub async fn expect_end<R: AsyncRead + Unpin>(r: &mut R) -> Result<(), FrameError> {
    let mut byte = [0u8; 1];
    match r.read(&mut byte).await? {
        0 => Ok(()),
        _ => Err(FrameError::TooLarge {
            kind: byte[0],
            len: 1,
            max: 0,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::io::Cursor;

    #[tokio::test]
    async fn frames_round_trip_and_limits_are_checked_before_allocation() {
        let mut buf = Vec::new();
        write_frame(&mut buf, FRAME_CHUNK, &[b"ab", b"cde"])
            .await
            .unwrap();
        assert_eq!(buf, [2, 5, 0, 0, 0, b'a', b'b', b'c', b'd', b'e']);
        let (kind, body) = read_frame(&mut Cursor::new(&buf), |_| 5).await.unwrap();
        assert_eq!((kind, body.as_slice()), (FRAME_CHUNK, &b"abcde"[..]));
        let err = read_frame(&mut Cursor::new(&buf), |_| 4).await.unwrap_err();
        assert!(
            matches!(err, FrameError::TooLarge { len: 5, max: 4, .. }),
            "{err}"
        );
        // A length of 4 GiB - 1 is refused without allocating it.
        let huge = [1u8, 0xFF, 0xFF, 0xFF, 0xFF];
        let err = read_frame(&mut Cursor::new(&huge), |_| 1 << 20)
            .await
            .unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { .. }));
        let err = read_frame(&mut Cursor::new(&buf[..7]), |_| 5)
            .await
            .unwrap_err();
        assert!(matches!(err, FrameError::Truncated), "{err}");
        let err = read_frame(&mut Cursor::new(&buf[..3]), |_| 5)
            .await
            .unwrap_err();
        assert!(matches!(err, FrameError::Truncated), "{err}");
        let err = read_frame(&mut Cursor::new(&[] as &[u8]), |_| 5)
            .await
            .unwrap_err();
        assert!(matches!(err, FrameError::Eof), "{err}");
    }
}
