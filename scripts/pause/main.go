// Command pause is the sandbox ("pause") process of the test tier's pods: it holds the pod's
// namespaces open, reaps zombies when it is the pod's PID 1, and exits on SIGINT or SIGTERM.
// Built static by scripts/build-control-plane.sh and packed into an image by the e2e harness
// (no image registry is reachable here, so the upstream pause image cannot be pulled).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	children := make(chan os.Signal, 16)
	signal.Notify(children, syscall.SIGCHLD)
	for {
		select {
		case <-stop:
			os.Exit(0)
		case <-children:
			for {
				pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
		}
	}
}
