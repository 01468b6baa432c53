//! The allocator installed as a program's global allocator, as the `tollgate` binary installs
//! it: the standard collections on several threads, blocks freed by a thread other than the
//! one that allocated them (a request's memory in the server), and types that need more than
//! the usual alignment.

use std::collections::HashMap;
use std::sync::mpsc;
use std::thread;

#[global_allocator]
static ALLOCATOR: tollgate_alloc::Allocator = tollgate_alloc::Allocator;

/// A type whose blocks must sit on a cache line of their own.
#[repr(align(128))]
struct Line([u8; 40]);

#[test]
fn blocks_freed_on_another_thread_are_reused_and_stay_aligned() {
    let (send, receive) = mpsc::sync_channel::<(Vec<u64>, Box<u128>, Box<Line>, String)>(64);
    let freer = thread::spawn(move || {
        let mut seen = 0u64;
        for (words, wide, line, text) in receive {
            assert_eq!(&*wide as *const u128 as usize % 16, 0);
            assert_eq!(&*line as *const Line as usize % 128, 0);
            assert_eq!(words.len() as u64, *wide as u64);
            assert!(line.0.iter().all(|&b| b == words.len() as u8));
            assert_eq!(text, format!("request {}", words.len()));
            seen += words.iter().sum::<u64>();
        }
        seen
    });
    let mut sent = 0u64;
    for round in 0..20_000u64 {
        let len = round % 97;
        let words: Vec<u64> = (0..len).collect();
        sent += words.iter().sum::<u64>();
        let wide = Box::new(u128::from(len));
        let line = Box::new(Line([len as u8; 40]));
        send.send((words, wide, line, format!("request {len}")))
            .unwrap();
    }
    drop(send);
    assert_eq!(freer.join().unwrap(), sent);
}

#[test]
fn hash_tables_grow_and_shrink_on_many_threads() {
    // hashbrown's tables ask for 16-byte alignment: the plain path, checked.
    let workers: Vec<_> = (0..4u64)
        .map(|worker| {
            thread::spawn(move || {
                for round in 0..200u64 {
                    let mut table = HashMap::new();
                    for key in 0..(round * 7 % 500) {
                        table.insert(key * 4 + worker, vec![key; (key % 5) as usize]);
                    }
                    for key in 0..(round * 7 % 500) {
                        assert_eq!(table[&(key * 4 + worker)].len(), (key % 5) as usize);
                    }
                    table.retain(|key, _| key % 3 == 0);
                    table.shrink_to_fit();
                    assert!(table.keys().all(|key| key % 3 == 0));
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
}
