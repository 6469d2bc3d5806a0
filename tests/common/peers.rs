//! Connections from chosen loopback addresses: every 127.0.0.0/8 address
//! is this machine on Linux, so a test can play several peers.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};

/// 127.0.0.`n`.
pub fn loopback(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, n))
}

fn socket_from(source: IpAddr) -> socket2::Socket {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(&SocketAddr::new(source, 0).into())
        .expect("bind a loopback source address");
    socket
}

/// A blocking connection to `addr` from `source`.
pub fn connect_from(source: IpAddr, addr: &str) -> TcpStream {
    let socket = socket_from(source);
    let to: SocketAddr = addr.parse().unwrap();
    socket.connect(&to.into()).expect("connect");
    socket.into()
}

/// A tokio connection to `addr` from `source`.
pub async fn connect_async_from(
    source: IpAddr,
    addr: &str,
) -> std::io::Result<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(source, 0))?;
    socket.connect(addr.parse().unwrap()).await
}
