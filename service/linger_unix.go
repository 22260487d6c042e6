//go:build unix

package service

import "syscall"

// lingerZero sets SO_LINGER 0 on the socket fd (see dialer).
func lingerZero(fd uintptr) error {
	return syscall.SetsockoptLinger(int(fd), syscall.SOL_SOCKET, syscall.SO_LINGER, &syscall.Linger{Onoff: 1, Linger: 0})
}
