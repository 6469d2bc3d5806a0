//! Loopback ports for the servers tests start and restart (redis-server,
//! PostgreSQL, Envoy, the example apps), chosen so that nothing else takes
//! one while its test holds it, including a server restarted on its port
//! and a second copy of the suite running beside this one.
//!
//! Two things could take a port between its choosing and its use: another
//! test choosing the same one, and the kernel giving it to an outgoing
//! connection as its source port. So ports come from below the kernel's
//! ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`, 32768 and up
//! by default), and each is reserved with an exclusive lock on a file named
//! for it in the system's temporary directory, held until this test's
//! process exits (the kernel drops the lock with the process, however it
//! ends).

use std::collections::hash_map::RandomState;
use std::fs::File;
use std::hash::{BuildHasher, Hasher};
use std::net::TcpListener;
use std::sync::Mutex;

/// The ports are drawn from here: below the ephemeral range.
const FIRST: u16 = 12_000;
const LAST: u16 = 32_000;
/// A cluster node's bus port is its port + 10000.
const BUS: u16 = 10_000;

/// Locks held for the life of this process.
static HELD: Mutex<Vec<File>> = Mutex::new(Vec::new());

/// A free loopback port reserved for this test (and, for cluster nodes,
/// `with_bus`, its bus port, +10000, too).
pub fn free_port(with_bus: bool) -> u16 {
    let seed = RandomState::new().build_hasher().finish();
    let last = if with_bus { LAST - BUS } else { LAST };
    let span = u64::from(last - FIRST);
    for i in 0..span {
        let port = FIRST + ((seed.wrapping_add(i.wrapping_mul(7_919))) % span) as u16;
        let Some(lock) = reserve(port) else { continue };
        let bus = if with_bus {
            match reserve(port + BUS) {
                Some(bus) => Some(bus),
                None => continue,
            }
        } else {
            None
        };
        let mut held = HELD.lock().unwrap();
        held.push(lock);
        held.extend(bus);
        return port;
    }
    panic!("no free loopback port in {FIRST}..{LAST}");
}

/// The port's lock file, locked, if no one holds it and the port is free
/// to listen on now.
fn reserve(port: u16) -> Option<File> {
    let dir = std::env::temp_dir().join("tollgate-test-ports");
    std::fs::create_dir_all(&dir).ok()?;
    let file = File::create(dir.join(port.to_string())).ok()?;
    file.try_lock().ok()?;
    TcpListener::bind(("127.0.0.1", port)).ok()?;
    Some(file)
}
