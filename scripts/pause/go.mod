module switchyard.local/pause

go 1.25
