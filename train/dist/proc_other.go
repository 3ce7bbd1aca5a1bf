//go:build !linux

package dist

import "syscall"

// rankProcAttr puts a rank in its own process group: a terminal's Ctrl-C
// reaches it once, forwarded by Launch.
func rankProcAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }
