//! What the benchmark examples share: reading `--name value` flags.

use anyhow::{anyhow, Result};
use std::str::FromStr;

/// The value after `name` in `args`, parsed; `default` when the flag is absent. A flag
/// without a value, or one that does not parse, is an error naming the flag.
pub fn arg<T: FromStr>(args: &[String], name: &str, default: T) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .ok_or_else(|| anyhow!("{name} needs a value"))?
            .parse()
            .map_err(|e| anyhow!("{name}: {e}")),
        None => Ok(default),
    }
}
