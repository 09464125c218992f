//! The upload cap (`--max-upload-rate`): one pacer shared by every outgoing exchange and
//! state-sync stream of a node, as a BitTorrent client caps its upload.
//!
//! Each chunk reserves its transmission slot on a shared timeline (`bytes / rate` long) and
//! the sender sleeps until that slot ends, so all streams together stay under the rate
//! whatever their number.

use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// A byte rate shared by every stream that holds it.
#[derive(Debug)]
pub struct UploadLimiter {
    bytes_per_s: u64,
    next_free: Mutex<Instant>,
}

impl UploadLimiter {
    /// A cap of `bytes_per_s` (at least 1).
    pub fn new(bytes_per_s: u64) -> Self {
        UploadLimiter {
            bytes_per_s: bytes_per_s.max(1),
            next_free: Mutex::new(Instant::now()),
        }
    }

    pub fn bytes_per_s(&self) -> u64 {
        self.bytes_per_s
    }

    /// Waits until `bytes` more may have left this node.
    pub async fn pace(&self, bytes: usize) {
        let until = self.reserve(bytes, Instant::now());
        tokio::time::sleep_until(until).await;
    }

    /// Books `bytes` on the shared timeline at `now` (after whatever is booked already) and
    /// returns when that slot ends.
    fn reserve(&self, bytes: usize, now: Instant) -> Instant {
        let mut next = self.next_free.lock().expect("upload limiter lock");
        let start = (*next).max(now);
        *next = start + Duration::from_secs_f64(bytes as f64 / self.bytes_per_s as f64);
        *next
    }
}

/// Parses a rate in bytes per second: a number with an optional decimal suffix `k`, `M` or
/// `G` (×1000), optionally followed by `B` or `B/s`: `500k`, `2M`, `1.5MB/s`, `100000`.
pub fn parse_rate(text: &str) -> Result<u64, String> {
    let bad = || {
        format!("{text:?} is not a rate in bytes per second (examples: 100000, 500k, 2M, 1.5MB/s)")
    };
    let t = text.trim();
    let t = t
        .strip_suffix("B/s")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (number, scale) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1e3),
        Some('M') => (&t[..t.len() - 1], 1e6),
        Some('G') => (&t[..t.len() - 1], 1e9),
        _ => (t, 1.0),
    };
    let value: f64 = number.trim().parse().map_err(|_| bad())?;
    let rate = value * scale;
    if !rate.is_finite() || rate < 1.0 || rate > u64::MAX as f64 {
        return Err(format!(
            "{text:?}: the upload rate must be at least 1 byte per second"
        ));
    }
    Ok(rate as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_or_name_the_problem() {
        assert_eq!(parse_rate("100000").unwrap(), 100_000);
        assert_eq!(parse_rate("500k").unwrap(), 500_000);
        assert_eq!(parse_rate("2M").unwrap(), 2_000_000);
        assert_eq!(parse_rate("1.5MB/s").unwrap(), 1_500_000);
        assert_eq!(parse_rate("3GB").unwrap(), 3_000_000_000);
        for bad in ["", "fast", "0", "-5k", "2X", "NaN"] {
            let e = parse_rate(bad).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[tokio::test]
    async fn streams_share_one_rate() {
        let limiter = UploadLimiter::new(1000);
        let now = Instant::now();
        // Two streams book at the same moment: the second slot follows the first.
        assert_eq!(limiter.reserve(500, now), now + Duration::from_millis(500));
        assert_eq!(limiter.reserve(1500, now), now + Duration::from_secs(2));
        // After an idle gap, booking starts from the present again.
        let later = now + Duration::from_secs(10);
        assert_eq!(
            limiter.reserve(250, later),
            later + Duration::from_millis(250)
        );
    }
}
