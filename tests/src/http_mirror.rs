//! A plain HTTP mirror of a directory on loopback, for the tests of shard fetching: GET
//! `/<file>` with an optional `Range: bytes=a-b` (answered 206 with `Content-Range`), in
//! one of three [`MirrorMode`]s. One std thread per connection; every read has a timeout,
//! and the server stops when dropped.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How the mirror answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorMode {
    /// The files' bytes.
    Honest,
    /// 404 for everything.
    NotFound,
    /// The right lengths, every byte flipped.
    WrongBytes,
}

/// A running mirror; stops when dropped.
pub struct HttpMirror {
    /// `http://127.0.0.1:<port>`
    pub url: String,
    /// Requests answered.
    pub requests: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl HttpMirror {
    /// Serves the files of `dir` on a free loopback port.
    pub fn start(dir: PathBuf, mode: MirrorMode) -> HttpMirror {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        listener.set_nonblocking(true).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let requests = Arc::new(AtomicU64::new(0));
        let (stop_flag, counter) = (stop.clone(), requests.clone());
        std::thread::spawn(move || {
            while !stop_flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let (dir, counter) = (dir.clone(), counter.clone());
                        std::thread::spawn(move || {
                            let _ = serve(stream, &dir, mode, &counter);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        HttpMirror {
            url,
            requests,
            stop,
        }
    }
}

impl Drop for HttpMirror {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Answers the requests of one connection (keep-alive) until the client closes it.
fn serve(
    stream: TcpStream,
    dir: &std::path::Path,
    mode: MirrorMode,
    counter: &AtomicU64,
) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut out = stream;
    // At most 1000 requests per connection: bounded.
    for _ in 0..1000 {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line)? == 0 {
            return Ok(());
        }
        let mut range: Option<(u64, Option<u64>)> = None;
        for _ in 0..100 {
            let mut header = String::new();
            reader.read_line(&mut header)?;
            let header = header.trim_end();
            if header.is_empty() {
                break;
            }
            let lower = header.to_ascii_lowercase();
            if let Some(spec) = lower.strip_prefix("range: bytes=") {
                let (a, b) = spec.split_once('-').unwrap_or((spec, ""));
                range = Some((a.parse().unwrap_or(0), b.parse().ok()));
            }
        }
        counter.fetch_add(1, Ordering::Relaxed);
        let path = request_line.split_whitespace().nth(1).unwrap_or("/");
        let name = path.trim_start_matches('/');
        let file = dir.join(name);
        let bytes = match (mode, name.contains('/') || name.contains("..")) {
            (MirrorMode::NotFound, _) | (_, true) => None,
            _ => std::fs::read(&file).ok(),
        };
        let Some(mut bytes) = bytes else {
            out.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")?;
            continue;
        };
        if mode == MirrorMode::WrongBytes {
            bytes.iter_mut().for_each(|b| *b ^= 0xff);
        }
        let total = bytes.len() as u64;
        match range {
            Some((start, end)) if start < total => {
                let end = end.unwrap_or(total - 1).min(total - 1);
                let body = &bytes[start as usize..=end as usize];
                write!(
                    out,
                    "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {start}-{end}/{total}\r\n\
                     Content-Length: {}\r\n\r\n",
                    body.len()
                )?;
                out.write_all(body)?;
            }
            Some(_) => {
                write!(
                    out,
                    "HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{total}\r\n\
                     Content-Length: 0\r\n\r\n"
                )?;
            }
            None => {
                write!(out, "HTTP/1.1 200 OK\r\nContent-Length: {total}\r\n\r\n")?;
                out.write_all(&bytes)?;
            }
        }
        out.flush()?;
    }
    Ok(())
}
