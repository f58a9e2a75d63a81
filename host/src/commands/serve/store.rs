//! The images OpenAI clients fetch by URL (`response_format: "url"`, the
//! default answer of OpenAI's older image models, which some clients still
//! ask for): each PNG kept in memory under a name of 128 random bits, the
//! name its only key (as OpenAI's signed URLs are: the URL works without
//! the API key, and cannot be guessed), for an hour, at most
//! [`MAX_IMAGES`] images and [`MAX_BYTES`] bytes, the oldest dropped first.
//! Nothing is written to disk.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Most images kept.
pub const MAX_IMAGES: usize = 64;
/// Most PNG bytes kept.
pub const MAX_BYTES: usize = 256 << 20;
/// How long an image's URL works (OpenAI's: 60 minutes).
pub const TTL: Duration = Duration::from_secs(3600);

struct Entry {
    name: String,
    png: Arc<Vec<u8>>,
    at: Instant,
}

/// The kept images (see the module docs).
pub struct ImageStore {
    entries: Mutex<VecDeque<Entry>>,
    max_images: usize,
    max_bytes: usize,
    ttl: Duration,
}

impl Default for ImageStore {
    fn default() -> Self {
        ImageStore::new(MAX_IMAGES, MAX_BYTES, TTL)
    }
}

impl ImageStore {
    /// A store of at most `max_images` images and `max_bytes` bytes, each
    /// kept for `ttl`.
    pub fn new(max_images: usize, max_bytes: usize, ttl: Duration) -> ImageStore {
        ImageStore {
            entries: Mutex::new(VecDeque::new()),
            max_images,
            max_bytes,
            ttl,
        }
    }

    /// Keeps `png` and returns its name (`<32 hex digits>.png`); the oldest
    /// images go where the limits say. An image larger than the byte limit
    /// alone is not kept (`None`), nor is one without random numbers.
    pub fn put(&self, png: Vec<u8>) -> Option<String> {
        if png.len() > self.max_bytes {
            return None;
        }
        let mut id = [0u8; 16];
        getrandom::fill(&mut id).ok()?;
        let name: String = id.iter().map(|b| format!("{b:02x}")).collect::<String>() + ".png";
        let mut e = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let mut bytes: usize = e.iter().map(|x| x.png.len()).sum::<usize>() + png.len();
        while !e.is_empty() && (e.len() >= self.max_images || bytes > self.max_bytes) {
            if let Some(old) = e.pop_front() {
                bytes -= old.png.len();
            }
        }
        e.push_back(Entry {
            name: name.clone(),
            png: Arc::new(png),
            at: Instant::now(),
        });
        Some(name)
    }

    /// The image named `name`, while its hour lasts.
    pub fn get(&self, name: &str) -> Option<Arc<Vec<u8>>> {
        let mut e = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let ttl = self.ttl;
        e.retain(|x| x.at.elapsed() < ttl);
        e.iter().find(|x| x.name == name).map(|x| x.png.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_random_and_limits_drop_the_oldest() {
        let s = ImageStore::new(2, 10, TTL);
        let a = s.put(vec![1; 4]).unwrap();
        let b = s.put(vec![2; 4]).unwrap();
        assert_ne!(a, b);
        assert!(a.len() == 36 && a.ends_with(".png"), "{a}");
        assert!(a[..32].bytes().all(|c| c.is_ascii_hexdigit()), "{a}");
        assert_eq!(*s.get(&a).unwrap(), vec![1; 4]);
        // A third image: two at most, so the first goes.
        let c = s.put(vec![3; 4]).unwrap();
        assert!(s.get(&a).is_none());
        assert!(s.get(&b).is_some() && s.get(&c).is_some());
        // 4 + 8 bytes is past 10: the older goes.
        let d = s.put(vec![4; 8]).unwrap();
        assert!(s.get(&b).is_none() && s.get(&c).is_none());
        assert_eq!(s.get(&d).unwrap().len(), 8);
        // Larger than the limit alone: not kept, nothing dropped.
        assert!(s.put(vec![5; 11]).is_none());
        assert!(s.get(&d).is_some());
        assert!(s.get("00000000000000000000000000000000.png").is_none());
    }

    #[test]
    fn images_expire() {
        let s = ImageStore::new(4, 100, Duration::ZERO);
        let a = s.put(vec![1; 4]).unwrap();
        assert!(s.get(&a).is_none());
    }
}
